"""Takes work out: the batched Celery task, the pipeline and its stages. Owns torch."""

import os

# OpenMP reads its wait policy once, when torch loads it, so it is set before any module here imports
# torch: a waiting thread sleeps instead of spinning on a core another process needs. Measured in
# workers/cpu_threads.py; an operator's own OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# mrc-worker: a stop while it imports ends it (shared/early_stop.py); main() takes the signals over.
import signal

from shared import early_stop

early_stop.install("mrc-worker", {signal.SIGTERM: 0, signal.SIGINT: 130, signal.SIGHUP: 0})
