"""What several protocols share (the shared protocol home).

Modules here know protocol wire conventions that more than one protocol package uses; they may
import only `server.core` and `server.http`, never a protocol package (import-linter keeps this
package below every protocol).
"""
