// esb_packages: fetching Python wheels on the host for sandboxes without network.
//   requirement.h   ParseRequirement, NormalizeName
//   version.h       PEP 440 Version / Specifier
//   wheel.h         wheel filenames, Target, WheelScore
//   simple_index.h  PEP 503 HTML / PEP 691 JSON project pages
//   url.h           URL parsing and resolution
//   http_fetcher.h  HttpFetcher, BeastHttpFetcher
//   wheel_cache.h   WheelCache, Wheel
#pragma once

#include "packages/http_fetcher.h"
#include "packages/requirement.h"
#include "packages/simple_index.h"
#include "packages/url.h"
#include "packages/version.h"
#include "packages/wheel.h"
#include "packages/wheel_cache.h"
