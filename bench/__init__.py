"""Benchmarks: every comparison measured side by side in one run, repeated, written as JSON, a markdown
table and a chart (`python -m bench --help`). One module per suite; `results` is what they all write,
`options` what they all read, `doubles` the stand-ins they share with the tests."""
