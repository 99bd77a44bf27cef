"""The Monitor: the one object a training loop touches, wiring the statistics, the engine, forensics, recovery and sinks. Imports every layer below it."""
