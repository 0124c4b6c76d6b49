import a.b as c, d
from x import (y,
  z as w)
