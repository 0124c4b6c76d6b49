from .. pkg import q
from . import r
