"""The benchmark study: methods x epsilons x seeds, aggregated into a report.

`spec` (the pipeline YAML), `benchmark` (runs on Ray, MLflow layout in `layout`),
`aggregate` (means and spreads over seeds), `benchmark_report` (Markdown and HTML) with its
`figures`.
"""
