"""The helpers of the ``dcp-compile`` commands, built on the library: what ``--model`` and
``--draft`` name and how it loads (``loading``), the export of the shipped pair
(``export``), its training (``training``), the correctness gate's rule (``gate``), and the
demo and gate runs of the DCP arm against the off arm (``arms``).  ``dcp_compile.serve``
is the serve command; ``dcp_compile.cli`` parses the command line and calls these."""
