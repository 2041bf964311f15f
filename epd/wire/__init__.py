"""What goes over the wire between EPD processes: gRPC servers and channels (``rpc``), the
cluster's mutual TLS (``tls``), and the conversions between our types and their protobufs
(``protocol``)."""
