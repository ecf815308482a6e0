"""One KFP component per pipeline stage: thin wiring from artifacts to kubellm calls.

Each body imports from kubellm, calls one function, writes its outputs. Logic lives in
src/kubellm, where it is tested without KFP.
"""
