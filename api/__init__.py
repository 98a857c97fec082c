"""The OpenAI-compatible API: a face of the product that calls the engine (engine/ never imports it).

`server.py` holds the routes (`ChatAPI`), `openai_chat.py` turns a request into the engine's
prompt, sampling and stop rules; `python -m api` serves them alone (`__main__.py`), and
`python app.py --api` mounts them beside the UI (app/api.py).
"""
