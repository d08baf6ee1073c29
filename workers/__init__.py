"""Takes work out: the batched Celery task, the pipeline and its stages. Owns torch."""

import os

# OpenMP reads its wait policy once, when torch loads it, so it is set before any module here imports
# torch: a waiting thread sleeps instead of spinning on a core another process needs. Measured in
# workers/cpu_threads.py; an operator's own OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
