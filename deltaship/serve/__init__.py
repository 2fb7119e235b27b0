"""`deltaship serve`: an OpenAI-compatible local server that holds many conversations' states on one session
(docs/serve.md). held.py: the held conversations; engine.py: generation and the queue; api.py: the request and
response shapes; constraints.py: where response_format / tools will plug in; app.py: the routes; run.py: starting it.
"""
