"""Puts work in. Must install and run without torch (`pip install '.[producer]'`)."""

# mrc, mrc-api: a stop while they import ends them (shared/early_stop.py); each main takes over.
import signal

from shared import early_stop

early_stop.install("mrc", {signal.SIGTERM: 143, signal.SIGINT: 130})
early_stop.install("mrc-api", {signal.SIGTERM: 0, signal.SIGINT: 130})
