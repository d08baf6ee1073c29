"""mrc-api's HTTP room: the front door every request passes (`front`: counting, keys and rate limits
from `guard`, body limits, faults as JSON), what the routes share (`state`), mrc's own routes (`jobs`:
/v1/jobs, /v1/events, probes, metrics; their request forms in `forms`) and the long-polls (`waits`).
producer/server.py assembles the app from this room and producer/openai/."""
