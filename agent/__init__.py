"""slatrace: explains why a latency-sensitive service misses its SLA."""

__version__ = "0.1.0"
