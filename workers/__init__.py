"""Takes work out: the batched Celery task, the pipeline and its stages. Owns torch."""
