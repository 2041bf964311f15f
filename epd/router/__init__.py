"""The router: the one request pipeline (``pipeline``), its backends (``backends/``), the front ends
that only translate (``http_app``, ``grpc_api``), and admission, routing, workers, media, metrics."""
