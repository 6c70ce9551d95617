"""rocketllm serve: an OpenAI- and Anthropic-compatible HTTP server over one streaming model.

    worker.py     the one thread that owns the model and runs jobs in arrival order (through text/loop.py, the
                  generation loop `generate` and `bench` use too: stop strings, cancellation, the prefix cache)
    fields.py, refusals.py, prepared.py, events.py   a request read field by field, refused in the API's names,
                  made the Prepared request the worker runs; its job's events as SSE
    prompts.py    chat messages (and tools) through the model's own chat template
    tools.py      tool-call parser families, chosen by reading the chat template
    openai_requests.py, openai_api.py  OpenAI request checks; its responses, stream events and error shape
    anthropic_requests.py, anthropic_api.py, responses_requests.py, responses_api.py   the same for Anthropic's
                  Messages API and OpenAI's Responses API
    routes.py     the endpoints, which need no key, the API a path answers in, the keys a request offers
    metrics.py    Prometheus text
    app.py        the FastAPI app (the only module that imports the server extra)

Nothing here but app.py imports FastAPI, so the worker and the parsers work in a base install.
"""
