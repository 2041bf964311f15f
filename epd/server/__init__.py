"""How EPD processes start: the tier scaffold every worker runs in (``tier``), the router process
(``router``), the local launcher and supervisor of ``epd serve`` (``local``, ``serve``), the Ray
launcher (``ray``), and the one definition of their command-line flags (``flags``). Nothing here
runs a request; everything that starts or stops a process lives here."""
