"""Measuring an engine: the run report, the kernel profile against the device's ceilings, and eval."""
