# Writes OUTPUT (tools/build_info.h) with the source tree's commit; leaves it untouched when
# unchanged so nothing rebuilds needlessly.
execute_process(COMMAND git -C ${SOURCE_DIR} describe --always --dirty
                OUTPUT_VARIABLE commit OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(NOT commit)
  set(commit unknown)
endif()
set(text "// Generated at build time.\n#pragma once\n#define BULKHEAD_COMMIT \"${commit}\"\n")
if(EXISTS ${OUTPUT})
  file(READ ${OUTPUT} old)
endif()
if(NOT "${old}" STREQUAL "${text}")
  file(WRITE ${OUTPUT} "${text}")
endif()
