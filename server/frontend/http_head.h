// What http_frontend.cpp takes from http_head.cpp (not a public header): ASCII helpers and the
// CORS policy's answers. parse_request_head itself is declared in frontend/http_frontend.h.
#pragma once

#include <string>
#include <string_view>

#include "frontend/http_frontend.h"

namespace burst::server {

// ASCII lower case.
std::string lower(std::string_view s);
// `s` in double quotes for a message, control and non-ASCII bytes escaped.
std::string quoted(std::string_view s);

// The CORS headers of a response to a request from `origin`: none unless it is allowed.
std::string cors_headers(const CorsPolicy& cors, const std::string& origin);
// A preflight's grants as header lines, or (in *why) what it asked that is not allowed.
std::string preflight_grants(const CorsPolicy& cors, const RequestHead& h, std::string* why);

}  // namespace burst::server
