"""Pure functions of (dataset, seed, epoch, rank): epoch order, sharding, resume state, mixing.

`plan.plan` holds the single-dataset `Plan` and the order versions; `plan.mix` the weighted
interleave of several. Order 2 is computed per position: `plan.window` (one dataset),
`plan.interleave` (a mix), both over `plan.permute`'s keyed bijections. No I/O.
"""
