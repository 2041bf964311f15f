"""``epd bench``: load generator and latency / goodput report for an EPD router (or any
OpenAI-compatible streaming server). Entry point: ``epd.bench.cli.main(argv)``."""
