variable "region" {
  description = "AWS region to deploy the gateway in (put it next to your GPU fleet)."
  type        = string
  default     = "us-east-1"
}

variable "lambda_zip_path" {
  description = "The zip built by `npm run build:lambda`."
  type        = string
  default     = "../../../../../dist/lambda/kvgate-gateway.zip"
}

variable "auth_tokens_json" {
  description = "Token table printed by `kvgate token` (hashes only, never raw tokens). Pass it with TF_VAR_auth_tokens_json."
  type        = string
  sensitive   = true
}
