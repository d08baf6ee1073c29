"""The nightly backlog's room: manifests read line by line (`manifest`), runs enqueued with resume,
backpressure and cancel, and their status and report (`run`), progress shown while a run enqueues
(`progress`), and `mrc backlog`'s own command line (`cli`). OpenAI batches run as backlog runs."""
