"""peagle: train P-EAGLE (parallel-drafting EAGLE-3) draft models offline and serve them in vLLM."""

__version__ = "0.1.0"
