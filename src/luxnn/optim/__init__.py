"""Optimisers as composable gradient transformations, in the style of optax.

A `GradientTransformation` is a pair of functions:

- ``init(params) -> opt_state``
- ``update(grads, opt_state, params=None) -> (updates, opt_state)``

The updates already carry the minus sign: ``apply_updates(params, updates)`` adds them.
The package is laid out as optax: `base` (the interface: `GradientTransformation`, the
`Stage` a building block subclasses and the capabilities it declares, `apply_updates`),
`combine` (`chain`), `fused` (the stages' CUDA fragments composed into one kernel over
all leaves), the building blocks by family (`scaling`, `momentum`, `adam`, `lion`,
`second_moments`, `clipping`, `decay_noise`, gathered in `transform`), `alias` (the named
optimisers, each a `chain` of building blocks), `schedule`, and `wrappers` (`masked`,
`multi_transform`, `MultiSteps`, `apply_if_finite`, `inject_hyperparams`).

>>> import numpy as np
>>> from luxnn import optim
>>> params = {"w": np.ones(3)}
>>> opt = optim.adam(1e-3)
>>> opt_state = opt.init(params)
>>> updates, opt_state = opt.update({"w": np.full(3, 0.5)}, opt_state, params)
>>> params = optim.apply_updates(params, updates)

Conventions the rest of luxnn relies on:

- No hidden state: everything an optimiser remembers is in `opt_state`, a tree of small
  NamedTuples whose leaves are arrays. Step counts are 0-d int64 arrays of the parameters'
  array module (NumPy or CuPy) and stay arrays inside `update` (no host round trip per
  step on a GPU: a schedule on a GPU runs at the count's host mirror, `arrays.host_count`),
  so the whole state saves and loads as a pytree of arrays.
- `update` is pure: it returns new update and moment arrays and never writes into `grads`,
  `params` or the old state (an old state stays valid, e.g. for a retried step). Its
  in-place twin `GradientTransformation.update_` gives the same numbers but writes the new
  moments into the old state's arrays (the state is consumed); `update_and_apply_` also
  adds each leaf's update into its parameter as soon as it is computed. The in-place
  training verbs (`apply_gradients_`, `single_train_step_`) run it; the others run `update`.
- Arithmetic runs in at least float32 and updates come back in the gradient's dtype, so
  float16 parameters keep float32 moments. Scalars enter as Python floats, so under NEP 50
  float32 arrays stay float32.
- Learning rates accept a float or a schedule (any callable of the step count, 0 on the
  first update).
- Optimisers are made of module-level classes and pickle and deep-copy (a user's lambda,
  e.g. as a mask, pickles only if pickle can find it).
"""

from .alias import *  # noqa: F403
from .alias import __all__ as _alias
from .base import *  # noqa: F403
from .base import __all__ as _base
from .combine import *  # noqa: F403
from .combine import __all__ as _combine
from .schedule import *  # noqa: F403
from .schedule import __all__ as _schedule
from .transform import *  # noqa: F403
from .transform import __all__ as _transform
from .update import *  # noqa: F403
from .update import __all__ as _update
from .wrappers import *  # noqa: F403
from .wrappers import __all__ as _wrappers

__all__ = [*_base, *_combine, *_update, *_transform, *_alias, *_schedule, *_wrappers]
