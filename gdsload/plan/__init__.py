"""Pure functions of (dataset, seed, epoch, rank): epoch order, sharding, resume state, mixing.

`plan.plan` holds the single-dataset `Plan`; `plan.mix` the weighted interleave of several. No I/O.
"""
