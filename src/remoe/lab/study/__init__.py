"""``remoe study``: grids of training runs from one YAML spec, resumable, with result tables.

spec (load, validate, expand), estimate (FLOPs and CPU time for --dry-run), runner (child
``remoe train`` processes, resume, state file), results (CSV / Markdown tables), cli.
"""
