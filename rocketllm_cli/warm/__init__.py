"""A warm model: `generate` keeps the model loaded in a background `serve` on a user-only unix socket, so the next
`generate` of the same model and load-time knobs attaches in milliseconds instead of importing torch and transformers
and loading again (ollama's keep-alive). Torch-free: the client side imports neither.

    registry.py  where warm servers are (one JSON file and one socket per model and knobs), and whether one is alive
    launch.py    find a warm server or start one (one at a time, under a lock), relaying its start-up lines
"""
