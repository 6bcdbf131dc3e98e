"""Configuration: the schemas, their validation, and labrun's resolvers (registered here, on the
package's first import, so that any process reading a config can resolve it)."""

from labrun.config import resolvers

resolvers.register()
