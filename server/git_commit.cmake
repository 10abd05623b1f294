# Writes OUT, a header defining ATTENTION_GIT_COMMIT: the commit the source tree SRC is checked out
# at (12 hex digits, "-dirty" when tracked files differ from it), or "unknown" when SRC is not a
# git checkout or git is missing. Run at every build (server/CMakeLists.txt), so a commit made
# after the configure is still the one reported; the header is rewritten only when it changes.
find_package(Git QUIET)
set(commit "unknown")
if(GIT_FOUND)
  execute_process(COMMAND "${GIT_EXECUTABLE}" -C "${SRC}" rev-parse --short=12 HEAD
                  OUTPUT_VARIABLE head OUTPUT_STRIP_TRAILING_WHITESPACE
                  RESULT_VARIABLE head_failed ERROR_QUIET)
  if(NOT head_failed AND head)
    set(commit "${head}")
    execute_process(COMMAND "${GIT_EXECUTABLE}" -C "${SRC}" status --porcelain
                            --untracked-files=no
                    OUTPUT_VARIABLE changes ERROR_QUIET)
    if(changes)
      set(commit "${commit}-dirty")
    endif()
  endif()
endif()
set(text "#define ATTENTION_GIT_COMMIT \"${commit}\"\n")
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
endif()
if(NOT old STREQUAL text)
  file(WRITE "${OUT}" "${text}")
endif()
