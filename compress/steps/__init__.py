"""The steps of one run, in the order compress/pipeline.py calls them.

load -> stages -> evaluate (in memory) -> write (model/) -> exports -> performance -> report (gates)
-> write (documents). Each module does one job and hands a small typed value to the next; none of
them imports compress.pipeline, and a step imports only the steps before it (their values and helpers).
"""
