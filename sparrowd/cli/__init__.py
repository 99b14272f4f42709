"""The ``sparrowd`` command (console script ``sparrowd.cli.main:main``): argument parsing, checks of
what was typed (``checks``) and the printing of results, one module per area: ``daemon`` (run, publish,
join, checkout, leave, status, wait), ``delta``, ``bench``, ``demo``, ``install``, ``token``, ``top`` (with
``topview``); ``status`` renders the status snapshot, ``progress`` a progress line.

It is the top of the house: it may import anything of sparrowd, and nothing else in sparrowd imports
it (code that needs a daemon starts one as ``python -m sparrowd.cli.main run``). A subcommand imports
its heavy parts (the benchmarks, torch, textual) inside its handler, so ``sparrowd status`` starts
without them.
"""
