// POST /run (one-shot Python) and POST /environments/{id}/run (stateful Python): the HTTP side
// of the core's run pipeline (core/run/run_pipeline.h, which decides tiers, fallback,
// throw-away environments, packages, artifacts and audits the run). This layer only parses the
// request into a RunSpec, calls the pipeline and renders its RunOutcome, as JSON or, with
// `Accept: text/event-stream`, as SSE with the answer as the last event.
#pragma once

#include "api/http_server.h"
#include "api/service.h"
#include "core/run/run_pipeline.h"

namespace esb::api {

// `pipeline` is not owned and must outlive the handler.
RunHandler MakeRunHandler(const run::RunPipeline* pipeline);

}  // namespace esb::api
