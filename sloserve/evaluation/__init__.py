"""The held-out evaluation suite (`sloserve evaluate`): every setting of a decision is a cell,
assigned to `dev` or `test` once and for all by a hash of its description (suite.py); policies
are tuned and iterated on dev (tune.py), and claims quote test. decisions/ says what each
decision runs and against what, metrics.py what is measured, verdict.py how a cell is judged,
runner.py runs the cells, report.py writes the tables, the figure and report.html."""
