"""Small-scale proxies of transformer training instabilities (Wortsman et al. 2023), CPU-sized."""
