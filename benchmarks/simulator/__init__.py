"""A discrete-event simulator of the service: the real bucket manager, block manager and
continuous-batching scheduler, with a roofline cost model standing in for the accelerators.

    python -m benchmarks.simulator {calibrate,offline,online,overhead,scale,all} --out DIR
"""
