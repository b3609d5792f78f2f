"""`make bench`: what slatrace costs, measured against bcc's runqlat on the same
workloads, so a change to the BPF code can be judged by numbers, not by feel.

Entry point: `python -m bench.run` (bench/run.py). Host-touching steps live in
bench/tools.py and bench/bpfstats.py; arithmetic and rendering stay pure so
they can be checked without root.
"""
