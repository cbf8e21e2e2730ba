"""`python -m train.serve`'s parts: the OpenAI API's shapes (`protocol`), the engine on its own thread
(`runner`), the FastAPI application (`app`), the Prometheus metrics (`metrics`) and the chat page
(`chat.html`)."""
