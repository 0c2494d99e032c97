"""The HTTP translation service (``aiayn serve``): aiayn's JSON API, LibreTranslate's, a web page.

A leaf of the package with its own dependency stack (FastAPI, uvicorn, python-multipart), so it
lives apart from the model and the translator, which never import it, and those dependencies are
the optional extra ``aiayn[serve]``: importing this package without them raises a one-line
:class:`aiayn.extras.MissingExtra` that says how to install them.
"""

from aiayn.extras import require

require("serve", "fastapi", "uvicorn", "python_multipart|multipart", needed_by="aiayn.serve")

from aiayn.serve.app import (  # noqa: E402
    Decoding,
    ServerSettings,
    create_app,
    serve,
    serve_in_background,
)

__all__ = ["Decoding", "ServerSettings", "create_app", "serve", "serve_in_background"]
