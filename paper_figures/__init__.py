"""Regenerate the paper's figures and tables: ``python -m paper_figures`` (``make repro``).

Usage::

    python -m paper_figures                      # every section, quick profile, into this package
    python -m paper_figures --profile full       # the large cases too
    python -m paper_figures --out DIR --only table1_memory fig1_memory

Each section computes or measures, writes JSON records (``zero.common.results``) to
``results/<name>.json``, and then draws its figures (``figures/*.png``) and tables
(``tables/*.md``) from that JSON, setting ours beside the paper's printed numbers
(:mod:`paper_figures.paper`) and counting the matches. A summary is printed at the end.

Adding a section:

1. Write ``paper_figures/<name>.py`` with ``NAME = "<name>"`` and
   ``run(*, profile: str, out: Outputs) -> list[SummaryRow]``. In ``run``, compute the records
   (``zero.common.results.make_record``), ``write_json(out.result(NAME), payload)``, then render
   from ``read_json`` of that path into ``out.figure(NAME)`` / ``out.table(NAME)`` (write with
   ``zero.common.results.write_atomic``). A results file holds ``{"section": NAME, "records":
   [...]}``. ``table2_max_model.py`` is a short example.
2. Append ``Section(name=<module>.NAME, run=<module>.run, about="...")`` to ``SECTIONS`` in
   ``paper_figures/sections.py``.

Legend: Ψ = num_params, N_d = world_size, K = the optimizer-state multiplier (12 for mixed-precision
Adam), MP = N_m, the model-parallel degree."""
