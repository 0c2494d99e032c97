"""The HTTP translation service (``aiayn serve``): aiayn's JSON API, LibreTranslate's, a web page.

A leaf of the package with its own dependency stack (FastAPI, uvicorn, python-multipart), so it
lives apart from the model and the translator, which never import it.
"""

from aiayn.serve.app import Decoding, ServerSettings, create_app, serve, serve_in_background

__all__ = ["Decoding", "ServerSettings", "create_app", "serve", "serve_in_background"]
