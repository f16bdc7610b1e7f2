// The translation unit the test suites' shared precompiled header is built with
// (tests/CMakeLists.txt, kvr_test_pch).
