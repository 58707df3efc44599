// The chat template's public entry points (common/jinja.h): parse and render. The interpreter's
// pieces (jinja_internal.h) throw Error; here it becomes a Status, so no exception leaves.
#include "common/jinja.h"

#include <exception>

#include "jinja_internal.h"

namespace burst::server::jinja {

Result<Template> Template::parse(const std::string& source) {
  try {
    auto root = std::make_shared<Node>();
    root->k = Node::K::kGeneration;  // a body rendered as it is
    root->body = parse_tokens(tokenize(source));
    Template t;
    t.root_ = std::move(root);
    return t;
  } catch (const Error& e) {
    return Status::error(e.message);
  } catch (const std::exception& e) {
    return Status::error(std::string("chat template: ") + e.what());
  }
}

Result<std::string> Template::render(const Value& context) const {
  if (!root_) return Status::error("chat template: nothing parsed");
  try {
    Renderer r(context);
    return r.run(root_->body);
  } catch (const Error& e) {
    return Status::error(e.message);
  } catch (const std::exception& e) {
    return Status::error(std::string("chat template: ") + e.what());
  }
}

}  // namespace burst::server::jinja
