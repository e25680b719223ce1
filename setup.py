"""Build the allocator's C core, the BLAS holds and the LSTM cell kernels with the package (``pip install -e .``)."""
import glob

import numpy
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "luxnn.memory._core",
            sources=sorted(glob.glob("src/luxnn/memory/csrc/*.c")),
            depends=sorted(glob.glob("src/luxnn/memory/csrc/*.h")),  # a changed header rebuilds; in the sdist too
            include_dirs=[numpy.get_include()],
            extra_compile_args=["-O2", "-std=c11", "-fvisibility=hidden"],  # only PyInit__core is exported
        ),
        Extension("luxnn._blas", sources=["src/luxnn/_blas.c"], extra_compile_args=["-O2", "-std=c11"]),
        Extension(
            "luxnn.ops._recurrent",
            sources=["src/luxnn/ops/_recurrent.c"],
            depends=["src/luxnn/ops/_recurrent_cell.h"],  # included once per dtype; in the sdist too
            include_dirs=[numpy.get_include()],
            extra_compile_args=["-O3", "-std=c11", "-fno-trapping-math"],  # so that the cell loops vectorise
        ),
    ]
)
