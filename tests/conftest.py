"""Shared test set-up: keep torch single-threaded per process so multi-process tests on 2
cores don't oversubscribe."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
