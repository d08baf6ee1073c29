"""The one intake: a request, from whichever surface, becomes a checked `Job` here and nowhere else.

`mrc submit`, `mrc backlog` manifest lines, `producer.client.Client`, `POST /v1/jobs`, a chat
completion and an OpenAI batch line each build a `Submission` and hand it to `Intake.job` (a batch
line's image goes through `Intake.upload_bytes` first), so the rules live in one place:

- `checks.py`: what a request may ask for (prompt and size limits, the response format, the lane,
  where its image may come from: a local file, an upload, an `s3://` URI the workers may read and,
  for an API key, one it may name), no I/O;
- `intake.py`: the job built from it (uploads, the namespaced id, the neutralised prompt, defaults);
- `request.py`: the request itself.

No HTTP and no command line here: surfaces turn their own form of a request into a `Submission`.
"""
