"""The HTTP toolkit both sides use: protocols build routes and answers with it, the server builds
each listener's app from those routes. It knows no protocol by name and reads no settings."""
