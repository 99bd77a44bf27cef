"""The plain data and pure helpers every layer shares: types, events, errors, strict JSON, maths, text, atomic files, HTTP redirects and deadlines, lazy imports.

May import: nothing else of nummon.
"""
