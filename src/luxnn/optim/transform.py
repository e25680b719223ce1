"""The building blocks of the optimisers: ``scale_by_*`` directions, clipping, decay,
noise, momentum and averages, each a `GradientTransformation` (optax's semantics unless a
docstring says otherwise). They live by family, as optax keeps them: `scaling` (by a
factor, a schedule, a trust ratio), `momentum` (`trace`, `ema`), `adam` (Adam and its
family), `lion`, `second_moments` (RMSprop, Adagrad, Adadelta, Adafactor), `clipping` (and
NaNs), `decay_noise` (weight decay, noise); `arithmetic` holds the leaf arithmetic they
share. This module gathers them.

Every block computes in at least float32 (`base.compute_dtype`), keeps its moments in that
dtype and returns updates in the gradient's dtype, so float16 parameters train without
their moments underflowing. A block's `update` returns new arrays and never writes into
`grads`, `params` or the old state; temporaries are combined in place (``out=``) on arrays
the block has just made. Its in-place update (`GradientTransformation.update_`) runs the
same operations in the same order with the old moments as the ``out=`` of the new ones,
so the two agree bit for bit. Step counts stay 0-d arrays: bias corrections are computed
from them as arrays, or in the fused kernel, with no read of the count (no host round trip
on a GPU: schedules run there at the count's host mirror, `arrays.host_count`; `add_noise`
alone reads it, to seed NumPy's generator on the host).
"""

from .scaling import *  # noqa: F403
from .scaling import __all__ as _scaling
from .momentum import *  # noqa: F403
from .momentum import __all__ as _momentum
from .adam import *  # noqa: F403
from .adam import __all__ as _adam
from .lion import *  # noqa: F403
from .lion import __all__ as _lion
from .second_moments import *  # noqa: F403
from .second_moments import __all__ as _second_moments
from .clipping import *  # noqa: F403
from .clipping import __all__ as _clipping
from .decay_noise import *  # noqa: F403
from .decay_noise import __all__ as _decay_noise

__all__ = [*_scaling, *_momentum, *_adam, *_lion, *_second_moments, *_clipping, *_decay_noise]
