"""Plain ``mlx_lm.server`` (the reference without any store) that prints the address it bound.

Why: the serving tests start every server with ``--port 0`` and read the port the system gave from the line
``kvshelf serve: listening on http://HOST:PORT``; mlx-lm itself logs only the port it was asked for (0). This runs
``mlx_lm.server.main`` unchanged except that the HTTP server class its ``run`` hands to ``_run_http_server`` (a
private name kvshelf relies on anyway: ``kvshelf.mlx_lm.upstream``) prints that line once it listens.
"""

from __future__ import annotations

import mlx_lm.server as mlx_server

from kvshelf.mlx_lm.serve.listening import reporting_server_class

_serve_http = mlx_server._run_http_server


def _reporting(host, port, generator, server_class=mlx_server.ThreadingHTTPServer,
               handler_class=mlx_server.APIHandler):
    _serve_http(host, port, generator, server_class=reporting_server_class(server_class), handler_class=handler_class)


if __name__ == "__main__":
    mlx_server._run_http_server = _reporting
    mlx_server.main()
