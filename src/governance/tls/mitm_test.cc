#include "governance/tls/mitm.h"

#include <gtest/gtest.h>
