"""The OpenAI-compatible room of mrc-api, for upstream systems written against OpenAI's API (the SDKs,
frameworks built on them, scripts written for vLLM): the request models (`protocol`) and what mrc makes
of a chat request (`chat_request`), one module per endpoint (`chat`, `models`, `files`, `batches`),
the batch machinery (`batch_book`, `batch_lines`, `batch_run`, `batch_output`), the answers
(`completion`), OpenAI's error shape (`errors`), and `routes`, which mounts them."""
