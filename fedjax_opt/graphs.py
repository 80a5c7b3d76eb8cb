"""Communication graphs and their mixing matrices: `fo.graphs`.

The code lives in `fedjax_opt.core.graphs` (NumPy only), on the ground floor,
because the core's mixing step (`fedjax_opt.core.mixing`) turns a `Graph`
into its matrix; this module is its public name.
"""

from fedjax_opt.core import graphs as _graphs
from fedjax_opt.core.graphs import *  # noqa: F401,F403  pylint: disable=wildcard-import,unused-wildcard-import

__all__ = list(_graphs.__all__)
